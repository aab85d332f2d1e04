"""The fleet side of keybatch: settings, admission policy, broker, CLI and tooling."""
