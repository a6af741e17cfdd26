"""EAGLE draft heads: a one-layer head that drafts from the target's own features.

``head.py`` the module and its files, ``features.py`` the target features of training text,
``train.py`` the training (``quantspec train-draft``), ``proposer.py`` the proposer
(``--draft eagle:FOLDER``).
"""
