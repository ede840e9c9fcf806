"""Bookkeeping without tensors: requests, KV blocks and the schedule."""
