"""Entrypoints: offline API, command line, HTTP server."""
