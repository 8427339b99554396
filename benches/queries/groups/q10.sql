-- DISTINCT over a string key and a small key (about 10^6 pairs).
SELECT count(*) AS n
FROM (SELECT DISTINCT s100k, k10 FROM facts) d
