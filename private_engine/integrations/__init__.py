"""Integrations with training frameworks: :mod:`.transformers` (``DPTrainer``, a Hugging Face
``Trainer`` that trains with the privacy engine). Each imports its framework only when used."""
