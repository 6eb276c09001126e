"""Pictures of what the engine does (matplotlib, imported only by the commands that draw)."""
