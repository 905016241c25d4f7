"""The edge's front end: audio in (`audio`), silero VAD (`vad`), streaming log-mel (`features`), the
pipeline that turns them into segments of features (`pipeline`) and the ONNX models beside them.

A leaf: both sides use it (the cloud's thin-client path runs the same front end on received audio).
The client that streams it to a server (sessions, replay, calls, transports, the meeting SDK) is
`harken.edge.client`; nothing here imports it.
"""
