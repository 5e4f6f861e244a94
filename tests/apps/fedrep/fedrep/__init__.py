"""fedrep: a Flower baseline, trimmed for rankaudit's tests."""
