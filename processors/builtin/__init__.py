"""Built-in logits processors, one file each."""
