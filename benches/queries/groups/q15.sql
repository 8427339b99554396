-- GROUP BY a nullable key.
SELECT n1k, count(*) AS n, sum(q) AS s
FROM facts
WHERE n1k IS NULL OR n1k < 10
GROUP BY n1k
ORDER BY n1k NULLS FIRST
