"""Integrations with torch: the torch.distributed process group, torch.compile's ops,
DDP-style gradient sync, torch's version floor and c10d's debug switches."""
