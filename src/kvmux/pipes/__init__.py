"""Built-in pipes, one module each; found through the ``kvmux.pipes`` entry points."""
