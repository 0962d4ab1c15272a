"""The llmrun command line: everything that touches the terminal."""
