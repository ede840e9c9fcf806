"""The server's web page: a live view of the engine (queues, the KV block pool, counters) and a
playground that streams from the server's own OpenAI endpoints. Static files only (``static/``:
plain HTML, JS and CSS, no build step), fed by one bounded snapshot stream (``feed``, ``routes``).
"""
