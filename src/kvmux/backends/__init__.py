"""Built-in backends, one module each; they are found through entry points like any plugin."""
