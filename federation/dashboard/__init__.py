"""`fedctl dashboard`: the federation live in a browser, for the operator who watches it while a
region joins or a site is broken on purpose.

It follows the schedulers' WatchState stream (the sites, their state and measured capacity),
scrapes the gateway's /metrics once a second (each site's tokens/s, TTFT and TPOT, resumed
streams) and pushes what changed to the page over SSE. An operator's tool on the top floor: it
may import anything below it, and nothing imports it (a drill marks its fault over HTTP).

server.py (HTTP, SSE, the background tasks) → board.py (what the page shows) ← federation/watch.py
(the schedulers), gateway_scrape.py and latency.py (the gateway), marks.py (a drill's marks).
"""
