"""fedrep: the algorithms it runs."""
from enum import Enum


class Algorithm(Enum):
    FEDAVG = "fedavg"
    FEDREP = "fedrep"
