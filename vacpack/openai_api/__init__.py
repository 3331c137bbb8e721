"""The OpenAI API's shapes, without HTTP: requests in, engine inputs and response bodies out.

Shared by the HTTP server (vacpack.server) and batch files (vacpack.batch), so a request means
the same thing and gets the same answer whichever way it arrives.
"""
