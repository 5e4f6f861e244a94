"""flpa: a federated app in the src layout."""
