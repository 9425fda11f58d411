"""Tools beyond the box: an environment's tool answered by a service over HTTP.

An environment that declares a `service` (a URL) has part of its replies
answered by a process the operator runs, not by the environment itself: a
retrieval index too large for every worker, a sandbox, anything on the
network. Every answer is signed by the service's key, which the run pins
(the environment's `service_key`, in run.json); workers attach the signed
answers to their batches and the trainer checks the signatures instead of
replaying the tool. Pure replies are replayed as before.

- `signed`: the call and the signed reply, and their checks;
- `client`: a worker's calls, with timeouts and bounded retries;
- `service`: the HTTP service over an `answer(query)` callable
  (`colonnade tools serve` puts an environment's tool behind it);
- `served`: what an environment with a service has, and the helpers both
  sides use to read it.

docs/environments.md ("Tools beyond the box") walks one through end to end.
"""
