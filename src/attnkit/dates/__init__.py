"""The date-normalisation application: the task (`task.py`), the translator built on `Transformer`
(`translator.py`), its training in processes (`training.py`) and the markers of what it refuses (`markers.py`)."""
