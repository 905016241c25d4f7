"""Hosting live sessions: the stream handler every transport calls, the session table, a hosted session and its server-side core, the thin clients' front end."""
