"""Model definitions built on pkvattn layers."""
