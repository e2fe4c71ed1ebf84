"""epdraft.models."""
