"""The link to the engines: one client per engine, the pool that finds them, the router that picks
one per request, and the requests in flight, continued on another engine when theirs is lost."""
