"""fedrep: the models it implements."""
