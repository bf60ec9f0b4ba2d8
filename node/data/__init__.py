"""Data and tokens: the --data sources as documents, tokenizers, the tokenized corpus and its cache, the batches of a shard."""
