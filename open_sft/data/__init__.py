"""Data preparation: read sources, validate rows, mix, apply the chat template, label, batch."""
