"""Data: prepared shards and tokenizers, chat rendering, the batches a run reads."""
