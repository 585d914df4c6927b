"""The persistent pool of torch.distributed workers (driver side and worker loop)."""
