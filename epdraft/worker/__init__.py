"""epdraft.worker."""
