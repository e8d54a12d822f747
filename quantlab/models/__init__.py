"""Models and data: loading by alias / path / hub id (loading), WikiText-2 and text files (data), and the
architecture table (arch)."""
