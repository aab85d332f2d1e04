"""The benchmarks behind `keybatch bench`, and the report helpers they share."""
