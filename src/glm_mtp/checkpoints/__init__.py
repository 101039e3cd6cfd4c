"""The shipped checkpoint(s), as package data: ``glm5-mtp-stdlib/`` (see its README.md)."""
