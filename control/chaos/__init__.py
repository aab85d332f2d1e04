"""`keybatch chaos`: faults injected into a live deployment under load."""
