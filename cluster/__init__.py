"""Several hosts as one server (SPEC 12): claims and the live set on Redis.

Imported only under `--cluster`; it needs the `redis` client (`tether[cluster]`).
"""
