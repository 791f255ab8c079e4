"""ntxctl, the supervisor and the client library."""
