"""The settings of a run: [tool.rankaudit], the command's flags and the round, resolved once."""
