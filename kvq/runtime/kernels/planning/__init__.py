"""Launch planning: how many programs a decode launch uses and which rows each reads."""
