"""tests/train: the training entry point (train_launch.py: torchrun launcher for the tests)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
