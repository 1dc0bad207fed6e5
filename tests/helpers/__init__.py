"""Code the test modules share, so that no test module imports another (``tests/`` is on ``sys.path`` in every
pytest run: pytest's rootdir insertion of the folder of ``tests/conftest.py``, which has no ``__init__.py``; import
them as ``from helpers.references import ...``):

- :mod:`helpers.references`: the rewards' image preprocessing as their official code defines it, written here
  independently (PIL / NumPy / ``torch.nn.functional``, nothing of stepflow), and the aesthetic predictor's head;
- :mod:`helpers.payloads`: pickles that run code when loaded, and the check that a loader refuses them;
- :mod:`helpers.tiny_text`: the tiny BERT vocabulary and med config of the ImageReward tests.

The tiny models and pipelines themselves live in :mod:`stepflow.testing` (configs name them too).
"""
