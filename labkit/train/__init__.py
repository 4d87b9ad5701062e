"""labkit.train: how the lab's own tiny models are made (`labkit train`).

corpus.py (stdlib sources + help topics, hash-chosen held-out split) -> tokenizer.py (byte-level
BPE) -> data.py (cached id streams) -> trainer.py (AdamW, cosine, resumable) -> export.py
(Hugging Face folder) -> card.py (README.md + train_log.json). presets.py holds the shapes.
"""
