import sys
from pathlib import Path

# tests import their helpers (signals.py) as top-level modules
sys.path.insert(0, str(Path(__file__).parent))
