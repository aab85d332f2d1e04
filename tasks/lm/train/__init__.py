"""Building and judging the local code models: corpus, training and quality."""
