"""What the viewer shows, as plain data: no Textual here (a test checks it)."""
