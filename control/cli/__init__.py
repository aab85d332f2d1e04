"""The `keybatch` command: the only layer that imports every other."""
