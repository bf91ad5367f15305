"""Limits of the HTTP front end that its options and the CLI share (no FastAPI import here)."""

# Request bodies over this many bytes get 413 before the rest is read: a body is held in memory whole
# (JSON), so without a cap one client could make the server hold gigabytes. 8 MiB holds a 128k-token
# prompt as token ids or as text, with room for JSON escapes.
DEFAULT_MAX_BODY_BYTES = 8 << 20
