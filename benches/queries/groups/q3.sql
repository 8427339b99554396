-- GROUP BY a unique key, HAVING over it.
SELECT count(*) AS n
FROM (SELECT id, sum(q) AS s FROM facts GROUP BY id HAVING sum(q) > 95) x
