"""Reference tasks (model + data) that need no download."""
