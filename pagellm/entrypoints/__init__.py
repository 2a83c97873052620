"""Entrypoints stage: offline API, command line, HTTP server."""
