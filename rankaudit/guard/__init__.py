"""The client-side guard: the update checked at the weights it was computed at, before it leaves the client."""
