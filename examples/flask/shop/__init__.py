"""A small Flask shop that runs its background work with runlane (see README.md)."""
