"""KV that moves between engines: the connector the scheduler calls (connector.py), the
handle one engine gives another (handle.py) and the transfer engine under them
(transport.py)."""
