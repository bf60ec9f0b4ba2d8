"""dtnode's protocol: everything that speaks the wire (codecs, all-reduce, membership, state sync)."""
