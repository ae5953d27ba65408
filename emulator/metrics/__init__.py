"""The device's Prometheus figures: what they are, read live at scrape time (figures.py), and the HTTP endpoint that serves them (http.py)."""
