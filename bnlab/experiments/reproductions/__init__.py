"""The papers' figures and tables, one module per figure, each exposing ``EXPERIMENTS``."""
