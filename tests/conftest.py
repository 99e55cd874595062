import os
import sys

# Make tests/ importable as a plain directory (attention_utils etc.).
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
